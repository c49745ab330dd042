"""The names of the values the MoE layer's stages read and write, beside their own intermediate ones."""

MOE_IN = "moe_in"  # the layer's input value, [tokens, hidden]
MOE_OUT = "moe_out"  # its output value
MOE_CAPACITY = "moe_capacity"  # a decode step's rows per destination rank (`ExpertParallelMoE.decode_stages`)
# a decode step's real rows: bool [tokens] on the device, the real rows first (False: a padding row of a captured
# step, sent to no expert), or None where every row is real
MOE_ACTIVE = "moe_active"

__all__ = ["MOE_ACTIVE", "MOE_CAPACITY", "MOE_IN", "MOE_OUT"]
