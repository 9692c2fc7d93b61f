# Homebrew formula: installs localllm into its own virtualenv under the Cellar.
# llama-cpp-python is built from source during install (Metal on Apple Silicon, ~6 min).
# Fill `url`/`sha256` from the release sdist (python -m build --sdist).
class Localllm < Formula
  include Language::Python::Virtualenv

  desc "Run GGUF language models locally (CLI, terminal chat, OpenAI/Ollama-compatible server)"
  homepage "https://github.com/localllm/localllm"
  url "https://files.pythonhosted.org/packages/source/l/localllm/localllm-0.1.0.tar.gz"
  sha256 "0000000000000000000000000000000000000000000000000000000000000000"
  license "MIT"

  depends_on "cmake" => :build
  depends_on "ninja" => :build
  depends_on "python@3.12"

  def install
    # Metal is llama.cpp's default on Apple Silicon; Linux brew builds the portable CPU backend
    ENV["CMAKE_ARGS"] = OS.mac? && Hardware::CPU.arm? ? "-DGGML_METAL=on" : "-DGGML_NATIVE=off"
    virtualenv_create(libexec, "python3.12")
    # pip resolves the dependencies inside the virtualenv (a tap formula; homebrew-core would need
    # every dependency as a `resource` block, see `brew update-python-resources`)
    system libexec/"bin/python", "-m", "pip", "install", "--no-binary", "llama-cpp-python", buildpath
    bin.install_symlink libexec/"bin/localllm"
  end

  service do
    run [opt_bin/"localllm", "serve"]
    keep_alive true
    log_path var/"log/localllm.log"
    error_log_path var/"log/localllm.log"
  end

  test do
    assert_match version.to_s, shell_output("#{bin}/localllm --version")
    system bin/"localllm", "list", "--catalog"
    system bin/"localllm", "doctor"
  end
end
