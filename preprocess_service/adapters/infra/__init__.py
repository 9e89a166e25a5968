"""What the service runs on: the memory budget and process memory, Prometheus metrics, the Redis
store shared by replicas."""
