"""The executor: plans run on streams, events and torch.distributed collectives."""
