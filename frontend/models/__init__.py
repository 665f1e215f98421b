"""The served models: the registry (name -> live version, leases, readiness) and rollouts."""
