"""`bert-port-bench`'s pieces: the harness (`harness`: report, interleaved timing, machine,
FLOPs, inputs, fresh processes) and one module per section: `throughput` (matmul roofline,
real text with the peers, fixed length), `peers` (CTranslate2, ONNX Runtime,
sentence-transformers), `load`, `import_time`, `finetune`, `profiling`. The command line is
`bert_port.cli.bench`."""
