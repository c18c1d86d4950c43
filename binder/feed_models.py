"""The change feed (what changed in the mirror, for the passes' incremental views), its
readers' positions, and the worker's checkpoints: the binder's bookkeeping tables.

Models of the binder app (``binder.models`` imports them, so Django registers them with the
rest); apart from the mirror's models because nothing here mirrors the cluster.
"""

from __future__ import annotations

from django.db import models
from django.db.models.functions import Now


class ChangeOp(models.TextChoices):
    INSERT = "I"
    UPDATE = "U"
    DELETE = "D"
    TRUNCATE = "T"
    ANCHOR = "A"


class Change(models.Model):
    """One entry of the change feed: a mirrored row was inserted,
    updated or deleted.

    Written by database triggers (migration 0005) in the writer's own transaction, so no
    write path (the ORM, bulk updates, raw SQL, the admin, ``load_snapshot``, the sync,
    the pass itself) can change a mirrored row without leaving an entry. ``position`` is
    the one ordered sequence; ``object_id`` is the row's primary key (a delete leaves
    its tombstone here); ``xid`` is the writer's transaction id on PostgreSQL, which lets
    a reader find entries whose positions were taken before but committed after its last
    read (see ``binder.runtime.state``). A ``T`` entry with kind ``*`` records a TRUNCATE:
    readers rebuild; an ``A`` entry is a reader's anchor on an otherwise empty feed. The pass
    worker is the reader; nothing else reads or writes it.
    """

    position = models.BigAutoField(primary_key=True)
    kind = models.CharField(max_length=32)
    object_id = models.BigIntegerField(null=True)
    namespace_id = models.BigIntegerField(null=True)
    name = models.CharField(max_length=253, blank=True)
    op = models.CharField(max_length=1, choices=ChangeOp.choices)
    xid = models.BigIntegerField(null=True, help_text="PostgreSQL: the writer's transaction id (xid8)")
    token = models.CharField(
        max_length=36, blank=True, help_text="random, per entry: a reader checks its last entry is still this one"
    )
    created = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "binder_change"
        ordering = ["position"]
        indexes = [models.Index(fields=["xid"], name="change_xid_idx")]

    def __str__(self) -> str:
        return f"#{self.position} {self.op} {self.kind} {self.object_id}"


class FeedReader(models.Model):
    """Where each pass worker has read the change feed up to, so pruning keeps what any
    live worker still needs.

    Workers take turns (two binder replicas share one queue); each follows the other's
    passes through the feed instead of reading everything again, which is sound only if
    no entry it has not applied was deleted. A pass deletes entries below the lowest
    ``position`` of the readers seen within ``GPUPLANE_FEED_RETENTION_SECONDS``, never
    those of the transactions in their ``horizon`` (in progress at their last read: they
    may commit below it), and deletes the rows of readers not seen for that long. A
    worker whose row is gone (it was judged stale) reads everything again. Rows are
    written in the pass's transaction, under the pass lock, so pruning and reading never
    interleave.
    """

    worker = models.CharField(max_length=200, unique=True)
    position = models.BigIntegerField()
    horizon = models.JSONField(default=list, blank=True)
    token = models.CharField(
        max_length=32, help_text="random, per pass: a pass rolled back leaves the previous one's; its worker rebuilds"
    )
    updated = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "binder_feed_reader"

    def __str__(self) -> str:
        return f"{self.worker} at #{self.position}"


class Checkpoint(models.Model):
    """A pass worker's in-memory state saved with its place in the change feed, so a new
    process (or a worker whose own place is no longer recorded) loads it and replays the
    feed after it instead of reading every mirrored row again (``binder.runtime.checkpoint``).

    Written after each verification and on a clean shutdown, in one transaction with the
    deletion of the older ones: a writer killed half way leaves the previous checkpoint.
    The data is a versioned, checksummed, compressed pickle that only this program writes
    and reads (``schema`` and ``checksum`` are checked before it is unpickled).
    """

    created = models.DateTimeField(db_default=Now())
    worker = models.CharField(max_length=200, help_text="the worker incarnation that wrote it")
    schema = models.CharField(
        max_length=80, help_text="the version and record layout of the data; another one is refused"
    )
    position = models.BigIntegerField(help_text="the change-feed position the state is current to")
    horizon = models.JSONField(default=list, blank=True)
    mark = models.CharField(max_length=36, blank=True)
    mark_at = models.BigIntegerField(default=0)
    token = models.CharField(max_length=32, help_text="matches the FeedReader row that keeps its entries")
    reconciled = models.BooleanField(
        default=True, help_text="saved with nothing left for the next full pass to reconcile (usage records)"
    )
    checksum = models.CharField(max_length=64, help_text="sha256 of data")
    size = models.BigIntegerField(default=0)
    data = models.BinaryField()

    class Meta:
        db_table = "binder_checkpoint"
        ordering = ("-id",)

    def __str__(self) -> str:
        return f"checkpoint #{self.pk} at #{self.position} ({self.size} bytes)"
