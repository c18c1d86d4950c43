"""The benchmarks: each module is run from the repository root as ``python -m bench.<name>``
(``--help`` says what it measures and takes); docs/benchmarks.md has their figures. They drive
the product as deployed and build what they need with the test harness (``harness``), which
they import as the tests do."""
