"""Load a GGUF model: file, hparams, tokenizer, chat template source.

Weights are not read here: the engine builds the architecture's network on
its backend (``Model.network``), which dequantizes or uploads them once.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Optional

from opencoti.engine.arch import ARCHITECTURES, arch_class
from opencoti.model.gguf_file import GGUFError, GGUFFile
from opencoti.model.hparams import HParams
from opencoti.model.kv_override import ReadTracker, apply_kv_overrides, unmatched_overrides

log = logging.getLogger("opencoti.model")


@dataclass
class Model:
    """A loaded GGUF model (read-only after load; safe to share across threads).

    gguf: the memory-mapped file; metadata: its key/values; hparams: typed
    shape; tokenizer: ``opencoti.model.tokenizer.Tokenizer``;
    chat_template_source: ``tokenizer.chat_template`` or None.
    """

    path: str
    name: str
    gguf: GGUFFile
    metadata: dict
    hparams: HParams
    tokenizer: object
    chat_template_source: Optional[str]
    _networks: dict = field(default_factory=dict, repr=False)

    @cached_property
    def n_params(self) -> int:
        """Parameters of the model: the elements of every tensor in the file (llama.cpp
        ``llama_model_n_params``; ``/v1/models`` ``meta.n_params``), counted once."""
        return sum(t.n_elements for t in self.gguf.tensors.values())

    def network(self, backend):
        """The architecture network with weights on ``backend`` (built once per backend), or
        split over a ``LayerSplit``'s backends (built once per split: ``-ngl``)."""
        key = getattr(backend, "key", backend.name)
        net = self._networks.get(key)
        if net is None:
            net = arch_class(self.hparams.arch)(self.gguf, self.hparams, backend)
            self._networks[key] = net
        return net


def load_model(path: Optional[str], params=None, with_tokenizer: bool = True) -> Model:
    """Open ``path`` (None -> the embedded default model) and read its header.

    ``params.kv_overrides`` (``--override-kv``) replace metadata values first
    (``Model.metadata`` is the overridden copy; the file is not modified); an
    override whose key is neither in the file nor read while loading gets a
    WARN naming it (it has no effect).
    Raises ``GGUFError`` for a corrupt/truncated file or an unsupported
    architecture (the message names the problem), ``FileNotFoundError`` if the
    file does not exist.
    """
    if path is None:
        from opencoti.model.default_model import default_model_path

        path = str(default_model_path())
    if not os.path.exists(path):
        raise FileNotFoundError(f"model file not found: {path}")
    gguf = GGUFFile(path)
    md = gguf.metadata
    overrides = getattr(params, "kv_overrides", None)
    if overrides:  # --override-kv: before hparams, tokenizer and template are read
        md = ReadTracker(apply_kv_overrides(md, overrides, path))
    arch = md.get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFError(f"{path}: missing general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{path}: unknown model architecture {arch!r} (supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    hp = arch_class(arch).load_hparams(md, path)
    tok = None
    if with_tokenizer:
        from opencoti.model.tokenizer import Tokenizer

        tok = Tokenizer.from_metadata(md)
    name = md.get("general.name") or os.path.basename(path)
    chat_template_source = md.get("tokenizer.chat_template")
    if isinstance(md, ReadTracker):
        for line in unmatched_overrides(overrides, gguf.metadata, md.read):
            log.warning("%s: %s", path, line)
        md = dict(md)
    return Model(
        path=path, name=str(name), gguf=gguf, metadata=md, hparams=hp, tokenizer=tok,
        chat_template_source=chat_template_source,
    )
