"""The proto's `ResponseFormat` ⇄ `StructuredOutputsParams`, for the gRPC service and the gRPC-backed client."""

from __future__ import annotations

import json

from jengine.errors import InvalidRequestError
from jengine.sampling.params import StructuredOutputsParams
from jengine.v1 import jengine_pb2 as pb

_TEXT_FIELDS = {"json_schema": "json", "regex": "regex", "grammar": "grammar", "structural_tag": "structural_tag"}


def structured_from_proto(request: pb.GenerateRequest) -> StructuredOutputsParams | None:
    """None for no format or "text"; an unknown type is INVALID_ARGUMENT naming response_format."""
    if not request.HasField("response_format"):
        return None
    fmt = request.response_format
    whitespace = {"disable_any_whitespace": not fmt.any_whitespace}
    if fmt.type in ("", "text"):
        if fmt.json_schema or fmt.regex or fmt.choice or fmt.grammar or fmt.structural_tag:
            raise InvalidRequestError("response_format carries a constraint but no type", param="response_format")
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True, **whitespace)
    if fmt.type == "choice":
        return StructuredOutputsParams(choice=list(fmt.choice))
    field = _TEXT_FIELDS.get(fmt.type)
    if field is None:
        raise InvalidRequestError(f"response_format.type {fmt.type[:40]!r} is not one of text, json_object, "
                                  f"json_schema, regex, choice, grammar, structural_tag", param="response_format")
    return StructuredOutputsParams(**{field: getattr(fmt, fmt.type)}, **whitespace)


def structured_to_proto(params: StructuredOutputsParams | None) -> pb.ResponseFormat | None:
    """The wire form of a constraint (None for none)."""
    if params is None:
        return None
    kind = params.kind
    fmt = pb.ResponseFormat(any_whitespace=not params.disable_any_whitespace)
    if kind == "json_object":
        fmt.type = "json_object"
    elif kind == "choice":
        fmt.type = "choice"
        fmt.choice.extend(params.choice)
    elif kind in ("json", "structural_tag"):
        fmt.type = "json_schema" if kind == "json" else "structural_tag"
        setattr(fmt, fmt.type, json.dumps(getattr(params, kind)))
    else:
        fmt.type = kind
        setattr(fmt, kind, getattr(params, kind))
    return fmt
