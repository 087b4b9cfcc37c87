"""The passes: Spec -> graph -> checked -> plans, predicted memory, agreement, dumps."""
