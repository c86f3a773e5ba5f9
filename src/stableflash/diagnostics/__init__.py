"""Measurements of attention numerics: the kernel-level mechanism probe (and, later, training probes)."""
