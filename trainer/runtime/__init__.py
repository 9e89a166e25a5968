"""The disaggregated runtime: layout and 1F1B order, point-to-point transfers, per-role workers."""
