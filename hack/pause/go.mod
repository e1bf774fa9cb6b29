module gemini.local/pause

go 1.25
