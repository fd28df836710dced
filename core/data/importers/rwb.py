"""The workbench's own JSON Lines format (what ``rwb episodes export`` writes).

::

    {"rwb_header": {"version": 1, "domain": "finance", "tools": [ToolSchema, ...]}}   (optional)
    {"episode_id": "e1", "domain": "finance", "task": {...}, "steps": [...], ...}     (Episode.to_json())
    ...

Episodes are taken exactly as written (their ``source`` included), so export → import →
export gives the same bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pydantic import ValidationError

from core.records.episodes import Episode, ToolSchema
from core.data.importers.base import (
    Document,
    Importer,
    ParsedFile,
    Prepared,
    RawRecord,
    ReadOptions,
    convert_each,
    dedupe_tools,
    prepare_fast,
    read_whole,
    register,
    validation_to_input_error,
)

HEADER_KEY = "rwb_header"
FORMAT_VERSION = 1


def header_line(domain: str | None, tools: list[ToolSchema]) -> dict[str, Any]:
    """The header object that opens an exported file."""
    return {HEADER_KEY: {"version": FORMAT_VERSION, "domain": domain,
                         "tools": [t.model_dump(mode="json") for t in tools]}}


def episode_from_line(doc: Document, rec: RawRecord, for_storage: bool = False) -> Episode | Prepared:
    """One episode line, validated; InputError located at the line and field.

    ``for_storage``: no model is needed (the fast path's dict is stored)."""
    if rec.text is not None:
        # Fast path: pydantic-core parses and validates the line in one go.  On any failure
        # the slow path below re-reads it strictly to say precisely what is wrong.
        prepared = prepare_fast(json_text=rec.text)
        if prepared is not None:
            if not for_storage:
                prepared.episode = Episode.model_validate(prepared.data)
            return prepared
    if rec.error is not None:
        raise rec.error
    value = rec.value
    if not isinstance(value, dict):
        raise doc.error(f"an episode must be an object, got {type(value).__name__}", rec)
    if HEADER_KEY in value:
        raise doc.error("a header is only allowed on the first line", rec, HEADER_KEY)
    try:
        return Episode.model_validate(value)
    except ValidationError as exc:
        raise validation_to_input_error(exc, doc, rec) from None


@register
class RwbImporter(Importer):
    format = "rwb"
    description = "The workbench's own JSON Lines (optional rwb_header line, then one episode per line)."

    def sniff(self, doc: Document, options: ReadOptions) -> bool:
        first = doc.first
        return doc.layout == "jsonl" and isinstance(first, dict) and (
            HEADER_KEY in first or ("episode_id" in first and "steps" in first))

    def read(self, doc: Document, options: ReadOptions) -> ParsedFile:
        return read_whole(self.stream(doc, options), options)

    def stream(self, doc: Document, options: ReadOptions) -> tuple[ParsedFile, Iterator[Prepared]]:
        domain, tools, body_doc = self.split_header(doc)
        parsed = ParsedFile(format=self.format, episodes=[], tools=tools, domain=domain,
                            default_dataset=doc.path.stem)

        def episodes() -> Iterator[Prepared]:
            domains: set[str] = set()
            for prepared in convert_each(body_doc, options,
                                         lambda rec: episode_from_line(body_doc, rec, options.for_storage),
                                         parsed.rejected, parse=False):
                domains.add(prepared.domain)
                yield prepared
            if domain is None and len(domains) == 1:  # the header's, or the one all episodes share
                parsed.domain = domains.pop()

        return parsed, episodes()

    def split_header(self, doc: Document) -> tuple[str | None, list[ToolSchema], Document]:
        """(domain, tools) from the header line when there is one, and the episode lines."""
        head = doc.head
        if head and head[0].error is None and isinstance(head[0].value, dict) \
                and HEADER_KEY in head[0].value:
            domain, tools = self._header(doc, head[0])
            return domain, tools, doc.after_first()
        return None, [], doc

    @staticmethod
    def _header(doc: Document, rec: RawRecord) -> tuple[str | None, list[ToolSchema]]:
        header = rec.value[HEADER_KEY]
        if not isinstance(header, dict):
            raise doc.error("the header must be an object", rec, HEADER_KEY)
        version = header.get("version", FORMAT_VERSION)
        if isinstance(version, bool) or not isinstance(version, int):
            raise doc.error("version must be a whole number", rec, f"{HEADER_KEY}.version")
        if version > FORMAT_VERSION:
            raise doc.error(f"file format version {version} is newer than this workbench "
                            f"({FORMAT_VERSION}); upgrade it", rec, f"{HEADER_KEY}.version")
        domain = header.get("domain")
        if domain is not None and not isinstance(domain, str):
            raise doc.error("domain must be text", rec, f"{HEADER_KEY}.domain")
        raw_tools = header.get("tools") or []
        if not isinstance(raw_tools, list):
            raise doc.error("tools must be a list", rec, f"{HEADER_KEY}.tools")
        tools = []
        for i, t in enumerate(raw_tools):
            try:
                tools.append(ToolSchema.model_validate(t))
            except ValidationError as exc:
                err = validation_to_input_error(exc, doc, rec)
                raise doc.error(err.reason, rec, f"{HEADER_KEY}.tools[{i}]"
                                + (f".{err.field}" if err.field else "")) from None
        return domain, dedupe_tools(tools)
