"""Generated gRPC modules for protos/disttrain_api/*.proto (do not edit; see disttrain_api.protogen)."""
