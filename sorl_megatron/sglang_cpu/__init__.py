"""The CPU stand-in for SGLang: a rollout server speaking SGLang's native HTTP API with HF
transformers on CPU (tests, the demo, CPU runs). ``python -m sorl_megatron.sglang_cpu.server``.

Layout: ``server.py`` command line and in-process start, ``app.py`` the HTTP endpoints
(``weight_endpoints.py`` the weight updates, ``endpoints.py`` their errors and what they share),
``parse.py`` ``/generate`` validation, ``options.py`` settings, ``engine.py`` the scheduler
thread, ``scheduler.py`` its continuous batching, ``forward.py`` prefill / decode / prefix cache,
``batch.py`` the running batch, ``sampling.py`` sampling and answers, ``model.py`` the served
model and weight updates, ``weight_groups.py`` distributed weight updates, ``weights.py``
checkpoint checks, ``precision.py`` fp32 / bf16 / emulated FP8. docs/concepts/rollout.md.
The trainer starts it as a subprocess by module name and never imports it.
"""
