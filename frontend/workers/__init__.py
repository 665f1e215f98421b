"""Several frontend worker processes on one port (FRONTEND_WORKERS): the supervisor, and the coordinator that
holds what they share (admission, rate limits, rollouts)."""
