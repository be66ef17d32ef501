"""Text layer (docs/parsers.md): ``tokenizer`` ids <-> text, ``detokenizer`` incremental
decoding, ``template`` sandboxed chat-template rendering, ``parser`` the streaming reasoning /
tool-call state machine, ``schema`` typing of tool-call values. Depends on no other m2serve layer."""
