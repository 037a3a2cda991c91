"""ggml formats: block layouts as data, bit-exact dequantizers, the kernel plane layout. No zoo imports."""
