"""The names of the values the MoE layer's stages read and write, beside their own intermediate ones."""

MOE_IN = "moe_in"  # the layer's input value, [tokens, hidden]
MOE_OUT = "moe_out"  # its output value
MOE_CAPACITY = "moe_capacity"  # a decode step's rows per destination rank (`ExpertParallelMoE.decode_stages`)

__all__ = ["MOE_CAPACITY", "MOE_IN", "MOE_OUT"]
