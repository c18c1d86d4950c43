"""Why a device stands where it does, as data: a code beside the human sentence.

A pass writes two things for each reason: the sentence a person reads (``status.reason``,
the decision log) and a :class:`Code` that code switches on. The sentence may gain words
(a choice passed over, what a borrowing order could not take) without any reader
noticing; the code is what the pass itself (keep a Lost set's first reason), the board and
the Lost page (a set waiting for borrowed GPUs to be taken back) read. Nothing parses a
reason's words to learn what it says: the codes are Kueue's machine reasons beside its
messages.
"""

from __future__ import annotations

from enum import StrEnum

from binder.engine.types import Device, Phase


class Code(StrEnum):
    """What kind of reason a device's ``reason`` is (stored beside it, ``reason_code``).

    The values are stored in the mirror and the decision log: rename a member freely, never
    a value. An empty code is a reason written before codes were stored (or by hand)."""

    #: Bound on the fullest node with room (a new order, or new members joining their set).
    BOUND = "Bound"
    #: New members bound next to their set on its node.
    GREW = "Grew"
    #: A Lost set bound again.
    REBOUND = "Rebound"
    #: A held set moved to another node (its node could not keep it, or it grew).
    MOVED = "Moved"
    #: A split set gathered onto one node.
    RESTORED = "Restored"
    #: Bound beyond the tenant's limits on GPUs nobody waited for (lending).
    BORROWED = "Borrowed"
    #: A borrowed set that the tenant's own usage now covers.
    REPAID = "Repaid"
    #: Held, but no node has room for the set.
    LOST = "Lost"
    #: Pending: no node that may take the set has room for it.
    NO_ROOM = "NoRoom"
    #: Pending: binding it would push a key of its tenant over budget.
    OVER_BUDGET = "OverBudget"
    #: Pending: none of the set's classes can take it (each passed over for its own reason).
    NO_CHOICE_FITS = "NoChoiceFits"
    #: Pending: the device's class does not exist.
    CLASS_MISSING = "ClassMissing"
    #: Pending: members of one set list different classes.
    CHOICES_DIFFER = "ChoicesDiffer"
    #: Pending: waiting for the rest of its set (Lost, or of a missing class).
    WAITING_FOR_SET = "WaitingForSet"
    #: Pending: a borrowed set that gave its GPUs back.
    RELEASED = "Released"
    #: Not placed: borrowed sets were marked to be taken back for it (the sentence names them).
    WAITS_FOR_RECLAIM = "WaitsForReclaim"
    #: Kept on an over-booked node: its VMI is pinned there, so its launcher waits for the
    #: units raw pods took (moving the set would strand the VMI on a node without its GPUs).
    CROWDED = "Crowded"
    #: A stopped VM's set moved to another node to make room for a waiting set (named).
    MADE_ROOM = "MadeRoom"


#: The word every Pending reason starts with: how a sentence that names the phase itself
#: (an answer's refusal, the catalog's "would not fit") leaves it out.
PENDING = "pending: "


def pending(detail: str) -> str:
    """A Pending device's reason: ``pending: <detail>``."""
    return PENDING + detail


def refusal(device: Device) -> str:
    """Why ``device`` is not placed, for a sentence that says so itself: a Pending device's
    reason without the word :func:`pending` put first (by its phase, not by its words), a
    Lost device's whole."""
    if device.phase is Phase.PENDING:
        return device.reason.removeprefix(PENDING)
    return device.reason
