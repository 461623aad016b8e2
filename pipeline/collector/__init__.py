"""The OTLP collector (``agentstream collector``): OpenTelemetry traces in, Span records out.

``receiver`` decodes and hands on what the SDKs send, ``mapping`` says what each OTel span becomes,
``http_front`` and ``grpc_front`` serve OTLP/HTTP and OTLP/gRPC, and ``main`` is the process.
"""
