"""The S3 word-problem demo, the main job of `make demo` (`examples/s3_demo/demo.py`)."""
