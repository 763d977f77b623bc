"""What protects the server from its callers: the shared interceptor wrapping (``interceptors``),
call limits (``limits``), malformed request bytes (``malformed``), TLS and the API key
(``security``), and client strings made safe to log (``redact``).
"""
