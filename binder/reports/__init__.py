"""Reports staff and the CLI read: the cluster state, budgets, decision history."""
