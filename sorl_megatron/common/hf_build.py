"""One lock for building transformers models in this process.

transformers builds a model (``from_pretrained``, ``from_config``) by swapping shared functions
for the length of the build: ``PreTrainedModel.tie_weights`` becomes a no-op, torch's default
dtype changes. Two builds at once on different threads (an embedded rollout server rebuilding
after a weight update while its caller loads a model) interleave those swaps; the later exit
restores the no-op, and from then on every model the process builds keeps a tied LM head
untied and randomly initialized. Every build in this project holds ``HF_BUILD_LOCK``. (The
default-dtype swap can still reach a thread that is not building while a build runs: harmless
while builds beside running threads are float32, as the rollout server's are.)
"""

from __future__ import annotations

import threading

HF_BUILD_LOCK = threading.RLock()
