"""OpenAPI post-processing: state in the schema what the API really refuses.

Django's form fields refuse a NUL character in any text parameter (400 naming the
parameter; PostgreSQL could not store it anyway). drf-spectacular does not say so, and
a client generated from the schema, or a fuzzer such as schemathesis, would take a
400 for a broken promise. This hook adds the rule to every free-text query and path
parameter.
"""

from __future__ import annotations

from typing import Any

#: Any text without a NUL character.
NO_NUL = "^[^\\x00]*$"


def no_nul_in_text_parameters(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    for path in result.get("paths", {}).values():
        for operation in path.values():
            for parameter in operation.get("parameters", []) if isinstance(operation, dict) else []:
                schema = parameter.get("schema") or {}
                if schema.get("type") == "string" and not ({"enum", "pattern", "format"} & set(schema)):
                    schema["pattern"] = NO_NUL
    return result
