"""Usage records and the tenant usage API (SPEC §7, §8); the records arrive with issue 5."""
