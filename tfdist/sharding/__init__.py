"""Who owns optimizer and gradient state: ZeRO stages, offload, checkpoint resharding."""
