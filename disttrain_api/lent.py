"""The control bytes at the start of a lent shared-memory microbatch (Microbatch.shm_token): its
token, then the byte the client sets once it has taken it. Shared by the service and the client;
free of protobuf, so the service's decode workers need not import it."""

TOKEN_BYTES, TAKEN_AT = 16, 16
