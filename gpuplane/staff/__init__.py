"""The staff console: the admin site and its pages that are no model's changelist."""
