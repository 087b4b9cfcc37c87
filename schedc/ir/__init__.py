"""The IR: plain data every stage shares (ops, the resolved Spec, plans, source spans)."""
