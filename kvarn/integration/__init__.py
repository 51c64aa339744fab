"""Integrations of kvarn into serving and modelling libraries, each imported only when used.

- :mod:`kvarn.integration.vllm`: the vLLM plugin (``--kv-cache-dtype kvarn_k4v2_g128``), loaded by
  vLLM through the ``vllm.general_plugins`` entry point.
- :mod:`kvarn.integration.hf`: a transformers cache that stores KVarN records.

Importing this package imports neither vLLM nor transformers.
"""
