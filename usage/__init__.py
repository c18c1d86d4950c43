"""Usage records and the tenant usage API."""
