"""What the editing adapters share: the ``source_size`` option and the one-conditioning-size check.

An editing adapter (``conditioning="text_and_image"``: FLUX.1 Kontext, Qwen-Image-Edit) resizes each source image
before encoding it. ``source_size`` (or the trainer config's ``source_image_size``) picks the size: ``"auto"`` (the
pipeline's own rule), ``"source"`` (the source's own size) or ``"output"`` (the generated height x width). The
adapter says what a source of a given size is encoded at (:meth:`source_size_of`); one batch holds rows of one
shape, so every row must give the same conditioning size (:meth:`check_source_sizes`, at set-up).
"""

from __future__ import annotations

SOURCE_SIZES = ("auto", "source", "output")


class SourceImageMixin:
    """Mixed in before a family's adapter: ``class FluxKontextAdapter(SourceImageMixin, FluxAdapter)``. The adapter
    calls :meth:`_init_source` in its ``__init__`` and defines ``source_size_of(image)``."""

    conditioning = "text_and_image"
    pipeline_tag = "image-to-image"
    reads_config_fields = ("source_image_size",)

    def _init_source(self, source_size: str | None, source_column: str, output_size: tuple[int, int] | None) -> None:
        if source_size is not None and source_size not in SOURCE_SIZES:
            raise ValueError(f"source_size={source_size!r}: must be one of {SOURCE_SIZES}")
        self._source_size_option = source_size
        self.source_size = source_size or "auto"
        self.source_column = source_column
        self.output_size = output_size  # (height, width) for source_size="output"; set by configure()

    def configure(self, config) -> None:
        super().configure(config)
        size = getattr(config, "source_image_size", "auto")
        if self._source_size_option is not None and size not in ("auto", self._source_size_option):
            raise ValueError(f"source_image_size={size!r} in the config, but the {type(self).__name__} was built with "
                             f"source_size={self._source_size_option!r}; set it in one place")
        self.source_size = self._source_size_option or size
        self.output_size = (config.height, config.width)

    def _need_output_size(self) -> tuple[int, int]:
        if self.output_size is None:
            raise ValueError("source_size='output' needs the generated size: pass output_size=(height, width) "
                             "or let a trainer configure the adapter")
        return self.output_size

    # what source_size_of returns -> the (height, width) the VAE encodes at; and how to say "one size" for it
    def _vae_size(self, key) -> tuple[int, int]:
        return key

    def _same_size_hint(self) -> str:
        return " and size" if self.source_size == "source" else ""

    def check_source_sizes(self, sizes, where) -> None:
        """Every row's source must give the same conditioning size (one batch holds rows of one shape). ``sizes``:
        each row's (width, height); raises one ``ValueError`` naming the first two rows that differ."""
        first = {}
        for row, size in enumerate(sizes):
            first.setdefault(self.source_size_of(size), (row, size))
            if len(first) > 1:
                (r1, s1), (r2, s2) = first.values()
                (h1, w1), (h2, w2) = (self._vae_size(k) for k in first)
                raise ValueError(
                    f"{where}: rows {r1} ({s1[0]}x{s1[1]} px) and {r2} ({s2[0]}x{s2[1]} px) are encoded at different "
                    f"sizes ({w1}x{h1} and {w2}x{h2}, source_size={self.source_size!r}); give every source one aspect "
                    f"ratio{self._same_size_hint()} (resize them first)")
