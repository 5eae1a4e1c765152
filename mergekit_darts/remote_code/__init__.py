"""The two files copied into every output directory (torch and transformers imports only)."""
