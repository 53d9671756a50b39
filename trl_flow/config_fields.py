"""What every config field carries besides its type and default: a help text and how a resumed run treats a change
of it. Ground floor: imports nothing of trl_flow.

``field(default=8, metadata=meta("refuse", "Group size G ..."))``. The metadata is a dict whose ``resume`` key is
hidden from iteration, because ``transformers.HfArgumentParser`` (so ``trl.TrlParser``) passes every key it sees to
``argparse.add_argument``: a config stays a plain dataclass that TrlParser turns into a command line, and
``field.metadata["resume"]`` still answers.
"""

from __future__ import annotations

#: How a resumed run treats a field whose value differs from the checkpoint's.
RESUME_KINDS = {
    "refuse": "refused: the checkpoint's weights, optimizer or stored trajectories would mean something else",
    "optimizer": "applied to the restored optimizer and learning-rate schedule",
    "notice": "applied from the resumed step on, and listed in the resume message",
    "harmless": "accepted silently: it does not change what is trained",
}


class FieldMetadata(dict):
    """Field metadata whose ``resume`` entry argparse never sees (``keys()`` and iteration skip it)."""

    def keys(self):
        return [k for k in super().keys() if k != "resume"]

    def __iter__(self):
        return iter(self.keys())

    def items(self):
        return [(k, self[k]) for k in self.keys()]


def meta(resume: str, help: str, **argparse_kwargs) -> FieldMetadata:
    """A config field's metadata: ``resume`` (one of :data:`RESUME_KINDS`) and its ``help`` text."""
    if resume not in RESUME_KINDS:
        raise ValueError(f"meta(resume={resume!r}): must be one of {list(RESUME_KINDS)}")
    return FieldMetadata(help=help, resume=resume, **argparse_kwargs)
