"""Who may do what, how much and for how long: API keys, admission, deadlines."""
