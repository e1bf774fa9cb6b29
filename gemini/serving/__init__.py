"""What every listener of the operator, the sidecar and the launcher shares so no client,
authenticated or not, can take it over: connection gates per source address, refusal logs
that fold a flood, probe listeners a flood cannot starve, the process's descriptor limit."""
