"""The VMI admission webhook: parse the review, decide, pin the VMI or ask the binder and wait."""
