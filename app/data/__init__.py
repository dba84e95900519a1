"""Data: record schema, video/image decoding through qwen-vl-utils, prompt building, synthetic demo data."""
