"""Generated gRPC modules for protos/disttrain_api/*.proto (do not edit; see preprocess_service.protogen)."""
