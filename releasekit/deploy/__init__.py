"""Deploy targets and the gateway: what serves which release, and the address in front."""
