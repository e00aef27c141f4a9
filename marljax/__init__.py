"""marljax: end-to-end RL of multi-agent LLM workflows in JAX. Importing it changes nothing global
(the CLIs opt in to keeping freed host memory: marljax/core/host_memory.py)."""
