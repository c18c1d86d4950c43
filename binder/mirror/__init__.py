"""The mirror: engine records read from rows, rows written from parsed objects, snapshots."""
