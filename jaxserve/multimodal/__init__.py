"""Images in: what a request's images become before they reach the engine (`inputs`), how they are read from URLs,
files and bytes (`media`), each family's preprocessing and placeholder layout (`qwen_vl`), and the loaded vision
tower the runner encodes them with (`vision`)."""
