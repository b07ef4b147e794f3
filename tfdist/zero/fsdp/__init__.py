"""ZeRO stage 3 (fully sharded data parallelism): every variable stored as one piece per replica (`param`),
gathered per layer for its forward and backward (`unit`), the stage-3 engine (`engine`, and `mesh_engine` when a
variable's replica copies live on their own devices), and its optimizer state per piece (`state`, `piece_state`)."""
