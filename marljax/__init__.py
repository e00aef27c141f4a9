"""marljax: end-to-end RL of multi-agent LLM workflows in JAX."""
from marljax import host_memory

host_memory.retain()  # before anything imports jax: see marljax/host_memory.py
