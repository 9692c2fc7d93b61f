from localllm.cli import main

main()
