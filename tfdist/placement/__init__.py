"""Where layers run: stage plans, balancing, micro-batch pipelining."""
