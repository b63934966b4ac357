"""Generated gRPC/protobuf wire code for pdserve (from proto/pdserve/v1 via proto/generate.py; do not edit)."""
