"""``torch.compile`` applied block by block, the way DDP and FSDP2 keep communication overlapped.

Compiling the whole model turns its backward into one autograd node, so DDP's gradient
buckets and FSDP2's reduce-scatters could only start once all of backward is done. Compiling
each transformer block keeps one node per block: communication of block *k* overlaps the
backward of block *k-1*, as without compilation.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["compile_modules"]


def compile_modules(model: Any, blocks: list[Any], options: bool | dict[str, Any]) -> str:
    """Compile each of ``blocks`` in place (``nn.Module.compile``), or ``model`` when there are none.

    Args:
        model: the whole ``nn.Module``.
        blocks: the modules to compile one by one (the transformer blocks).
        options: ``True`` (torch's defaults) or keyword arguments of ``torch.compile``.

    Returns:
        What was compiled, for the log.
    """
    kwargs = {} if options is True else dict(options)
    if blocks:
        for block in blocks:
            block.compile(**kwargs)
        what = f"{len(blocks)} block(s)"
    else:
        model.compile(**kwargs)
        what = "the whole model"
    logger.info("torch.compile %s %s", what, kwargs or "(defaults)")
    return what
