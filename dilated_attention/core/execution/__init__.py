"""How a plan's kernel calls run: the executor, merged runs, slots, groups, the fused engine."""
