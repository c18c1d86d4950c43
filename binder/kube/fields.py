"""Shared field parsing for every mirrored kind: typed access to one object's fields
(strings, maps, lists, whole-number Kubernetes quantities, RFC 3339 times), the length
limits the mirror's columns are sized for, and the error that names the object and field.

Every problem is reported as an :class:`ObjectError` naming the object and the field,
because an operator fixing a 5,000-object dump needs to know exactly where to look; the
kinds' own parsers (``binder.kube.core`` and ``binder.kube.resources``) stand on this.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from kubernetes.utils.quantity import parse_quantity

#: Kubernetes' length limits, which the mirror's columns are sized for: object names
#: (DNS subdomains), namespace names (DNS labels), UIDs, and the bind request ids.
NAME_MAX = 253
NAMESPACE_MAX = 63
UID_MAX = 64
KIND_MAX = 64
PHASE_MAX = 32
REQUEST_ID_MAX = 128

#: The largest count the mirror's integer columns hold (PostgreSQL ``integer``, and what
#: SQLite and JSON keep exactly): unitsPerDevice, allocatable, limits, requests.
COUNT_MAX = 2**31 - 1
#: How much of a refused value an error message quotes: enough to recognise it, never a
#: tenant's megabyte of text in a log line or an admin page.
QUOTE_MAX = 40
#: Longer quantity strings are refused unparsed (Kubernetes' own quantities are short).
QUANTITY_MAX = 64


def quote(value: Any) -> str:
    """``repr(value)`` cut to :data:`QUOTE_MAX` characters: error messages quote a short
    prefix of a refused value (escaped, so a NUL or a lone surrogate is shown, not written)."""
    text = repr(value) if isinstance(value, str) else f"{type(value).__name__} {_short_repr(value)}"
    return text if len(text) <= QUOTE_MAX else text[:QUOTE_MAX] + f"... ({len(text)} characters)"


def _short_repr(value: Any) -> str:
    if isinstance(value, (Mapping, list, tuple)):
        return f"of {len(value)} items"
    text = repr(value)
    return text if len(text) <= QUOTE_MAX else text[:QUOTE_MAX] + "..."


def text_problem(value: str) -> str | None:
    """Why ``value`` cannot be stored as text, or None.

    PostgreSQL's text and jsonb refuse NUL, and a lone surrogate (``"\\ud800"`` in JSON)
    is not encodable as UTF-8 on either database: one such character in one tenant's
    field used to fail the whole write, and with it the sync or the pass.
    """
    if "\x00" in value:
        return "must not contain a NUL character"
    if any("\ud800" <= ch <= "\udfff" for ch in value):
        return "must not contain a lone surrogate (not valid Unicode text)"
    return None


def safe_text(value: str) -> str:
    """``value`` with NUL and lone surrogates escaped: safe to log and store in an error text."""
    if text_problem(value) is None:
        return value
    return "".join(repr(ch)[1:-1] if ch == "\x00" or "\ud800" <= ch <= "\udfff" else ch for ch in value)


class ObjectError(ValueError):
    """A problem with one object, naming it and the field."""

    def __init__(self, ref: str, field: str, message: str) -> None:
        self.ref, self.field, self.message = ref, field, message
        super().__init__(f"{ref}: {field}: {message}" if field else f"{ref}: {message}")


@dataclass(frozen=True)
class Parsed:
    """One parsed object: its kind, namespace ("" if cluster-scoped), name and row values."""

    kind: str
    namespace: str
    name: str
    values: dict[str, Any]


def describe(obj: Mapping[str, Any]) -> str:
    kind = obj.get("kind") or "object"
    raw_meta = obj.get("metadata")
    meta: Mapping[str, Any] = raw_meta if isinstance(raw_meta, Mapping) else {}
    name = meta.get("name") or meta.get("generateName") or "<no name>"
    namespace = meta.get("namespace")
    # A name that is not a string is named by its type, never str()-ed (it may be a
    # mapping of a million items); text is escaped and cut like any quoted value.
    parts = [_ref_part(part) for part in (kind, namespace, name) if part]
    return f"{parts[0]} {'/'.join(parts[1:])}" if len(parts) > 1 else parts[0]


def _ref_part(value: Any) -> str:
    if not isinstance(value, str):
        return f"<{type(value).__name__}>"
    text = safe_text(value)
    return text if len(text) <= NAME_MAX else text[:QUOTE_MAX] + "..."


class Reader:
    """Typed access to one object's fields, raising ObjectError with the field path."""

    def __init__(self, obj: Mapping[str, Any]) -> None:
        self.obj = obj
        self.ref = describe(obj)

    def fail(self, field: str, message: str) -> ObjectError:
        return ObjectError(self.ref, field, message)

    def get(self, path: str, default: Any = None) -> Any:
        node: Any = self.obj
        walked: list[str] = []
        for part in path.split("."):
            if node is None:
                return default
            if not isinstance(node, Mapping):
                raise self.fail(".".join(walked), f"must be a mapping, got {type(node).__name__}")
            walked.append(part)
            node = node.get(part)
        return default if node is None else node

    def string(self, path: str, *, required: bool = False, default: str = "", max_length: int | None = None) -> str:
        value = self.get(path)
        if value is None or value == "":
            if required:
                raise self.fail(path, "is required")
            return default
        if not isinstance(value, str):
            raise self.fail(path, f"must be a string, got {quote(value)}")
        return self.limited(path, value, max_length)

    def limited(self, path: str, value: str, max_length: int | None) -> str:
        """``value``, if it is storable text and fits the mirror's column (Kubernetes' own limits)."""
        self.text(path, value)
        if max_length is not None and len(value) > max_length:
            raise self.fail(path, f"must be at most {max_length} characters, got {len(value)}")
        return value

    def text(self, path: str, value: str) -> str:
        """``value`` if it is text both databases can store (no NUL, no lone surrogate)."""
        problem = text_problem(value)
        if problem is not None:
            raise self.fail(path, f"{problem}, got {quote(value)}")
        return value

    def key(self, path: str, key: Any) -> str:
        """A map key that becomes a JSON key in the mirror: a string, storable, of sane length."""
        if not isinstance(key, str):
            raise self.fail(path, f"keys must be strings, got {quote(key)}")
        return self.limited(f"{path}[{safe_text(key)[:QUOTE_MAX]}]", key, NAME_MAX)

    def mapping(self, path: str) -> dict[str, Any]:
        value = self.get(path)
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise self.fail(path, f"must be a mapping, got {type(value).__name__}")
        return dict(value)

    def string_map(self, path: str) -> dict[str, str]:
        result = {}
        for key, value in self.mapping(path).items():
            name = self.key(path, key)
            if not isinstance(value, str):
                raise self.fail(f"{path}[{name}]", f"must be a string, got {quote(value)}")
            result[name] = self.text(f"{path}[{name}]", value)
        return result

    def listing(self, path: str) -> list[Any]:
        value = self.get(path)
        if value is None:
            return []
        if not isinstance(value, list):
            raise self.fail(path, f"must be a list, got {type(value).__name__}")
        return value

    def boolean(self, path: str, default: bool = False) -> bool:
        value = self.get(path)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(path, f"must be true or false, got {quote(value)}")
        return value

    def integer(self, path: str, *, default: int | None = None, minimum: int | None = None) -> int:
        value = self.get(path)
        if value is None:
            if default is None:
                raise self.fail(path, "is required")
            return default
        return self.count(path, value, minimum=minimum)

    def count(self, path: str, value: Any, *, minimum: int | None = None) -> int:
        """A whole-number quantity already read (map values whose keys hold dots)."""
        units = self.units(path, value)
        if units > COUNT_MAX:
            raise self.fail(path, f"must be at most {COUNT_MAX}, got {quote(value)}")
        if minimum is not None and units < minimum:
            raise self.fail(path, f"must be at least {minimum}, got {units}")
        return units

    def units(self, path: str, value: Any) -> int:
        """A whole-number quantity (``2``, ``"2"``, ``"1k"``)."""
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise self.fail(path, f"must be a whole number, got {quote(value)}")
        if isinstance(value, str) and len(value) > QUANTITY_MAX:
            raise self.fail(path, f"is not a Kubernetes quantity: {quote(value)}")
        try:
            quantity = parse_quantity(value)
        except (ValueError, ArithmeticError):
            raise self.fail(path, f"is not a Kubernetes quantity: {quote(value)}") from None
        if not quantity.is_finite() or abs(quantity) > COUNT_MAX:
            # before to_integral_value and int(): "1e5000" would become a 5,000-digit int
            raise self.fail(path, f"must be at most {COUNT_MAX}, got {quote(value)}")
        if quantity != quantity.to_integral_value():
            raise self.fail(path, f"must be a whole number of units, got {quote(value)}")
        return int(Decimal(quantity))

    def timestamp(self, path: str) -> datetime | None:
        return self.time_value(path, self.get(path))

    def time_value(self, path: str, value: Any) -> datetime | None:
        if value is None or value == "":
            return None
        if isinstance(value, datetime):  # YAML loaders may already parse timestamps
            parsed = value
        elif isinstance(value, str):
            try:
                parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                raise self.fail(path, f"is not an RFC 3339 time: {quote(value)}") from None
        else:
            raise self.fail(path, f"is not an RFC 3339 time: {quote(value)}")
        if parsed.tzinfo is None:
            raise self.fail(path, f"needs a time zone (e.g. a trailing Z): {quote(value)}")
        try:
            return parsed.astimezone(UTC)  # PostgreSQL takes offsets only up to ±15:59
        except OverflowError:
            raise self.fail(path, f"is outside the years 1-9999 in UTC: {quote(value)}") from None

    def name(self, max_length: int = NAME_MAX) -> str:
        return self.string("metadata.name", required=True, max_length=max_length)

    def namespace(self) -> str:
        return self.string("metadata.namespace", required=True, max_length=NAMESPACE_MAX)


def check_api(r: Reader, expected: tuple[str, ...]) -> None:
    api = r.string("apiVersion", required=True)
    if api not in expected:
        raise r.fail("apiVersion", f"must be {' or '.join(expected)}, got {quote(api)}")
