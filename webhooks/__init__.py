"""The VMI admission webhook (SPEC §5); the endpoint arrives with issue 4."""
