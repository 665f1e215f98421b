"""Generation over the engine protocol: the serving layer, the protocol, its Triton implementation,
stop strings."""
